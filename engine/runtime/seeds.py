"""Step seeds: the seed every step of a run (or of a branch) is decided with.

Derived, never drawn: step k of a run with root seed r always gets the same seed, so a replay
re-decides it with the seed it was recorded with, and a branch made with seed b draws its own
seeds from b alone (docs/decisions.md, entry 8)."""

from __future__ import annotations

import hashlib
import os


def step_seed(root_seed: int, step: int) -> int:
    """The seed of step `step` of a run with root seed `root_seed`: the first 8 bytes of
    blake2b("car-step:<root>:<step>") as a big-endian integer, masked to 63 bits."""
    digest = hashlib.blake2b(f"car-step:{root_seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


def branch_stream(root_seed: int, branch_seed: int) -> int:
    """The seed a branch's steps are drawn from (`step_seed(branch_stream(r, b), k)`): its
    branch seed mixed with the root seed of the run it belongs to. A branch seed is public (it
    follows from the `--seed` a fork or an attribution was given); were a branch's step seeds
    drawn from it alone, anyone could re-decide each of its steps with an agent's public
    configuration and the seed, and see which agent does not reproduce: on a policy that is
    deterministic given its seed, the mole (decision 62)."""
    digest = hashlib.blake2b(f"car-branch:{root_seed}:{branch_seed}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big") & ((1 << 63) - 1)


def fresh_seed() -> int:
    """A root seed nobody chose: 63 random bits. A heist draws its world and its mole from
    its root seed, and the world shows in every tool result; with 32 bits a search of every
    seed for the world shown (minutes on a laptop) named the seed, hence the mole. 63 bits
    leave many seeds for any world, among which the mole is as likely any agent."""
    return int.from_bytes(os.urandom(8), "big") >> 1
