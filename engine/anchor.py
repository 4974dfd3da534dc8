"""Anchors: keyed digests of every run's head, kept outside the journal.

A hash chain shows an edit only to someone who cannot re-chain. Whoever can write the journal
file can rewrite a run from any seq on and recompute every later hash, cut its tail, delete it,
or change its row. An anchor taken earlier and kept elsewhere catches all four: per run it holds
the head (number of events), the hash of the last event, marks (seq, hash) every MARK_EVERY
events of the run's own slice (to say *where* a rewrite starts), and a digest of the run row.
The whole document is authenticated with HMAC-SHA256 under a key the journal's writers need not
know, so the anchor itself cannot be forged or edited unnoticed. Format in docs/decisions.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

import msgspec

from engine.errors import JournalError
from engine.journal import HASH_PREFIX, Journal, RunInfo

FORMAT = "car-anchor/1"
MAC_ALG = "hmac-sha256"
MARK_EVERY = 64
MIN_KEY_BYTES = 16
KEY_ENV = "CAR_ANCHOR_KEY"
KEY_FILE_ENV = "CAR_ANCHOR_KEY_FILE"


class AnchorError(JournalError):
    """The anchor file or its key is missing, malformed, or does not authenticate."""


def load_key(key_file: str | os.PathLike[str] | None = None) -> bytes:
    """The anchor key: `key_file`, else $CAR_ANCHOR_KEY_FILE, else $CAR_ANCHOR_KEY itself."""
    path = key_file or os.environ.get(KEY_FILE_ENV)
    if path:
        try:
            key = Path(path).expanduser().read_bytes().strip()
        except OSError as e:
            raise AnchorError(
                f"cannot read anchor key {str(path)!r}: {e.strerror}; make one with "
                f"`head -c 32 /dev/urandom | base64 > {path}`"
            ) from e
    else:
        key = os.environ.get(KEY_ENV, "").encode()
        if not key:
            raise AnchorError(
                f"an anchor needs a key: pass --key-file FILE, or set ${KEY_FILE_ENV} or ${KEY_ENV}"
            )
    if len(key) < MIN_KEY_BYTES:
        raise AnchorError(f"anchor key is {len(key)} bytes; use at least {MIN_KEY_BYTES}")
    return key


def key_id(key: bytes) -> str:
    """Names a key without revealing it, so verify can tell 'wrong key' from 'altered'."""
    return hashlib.blake2b(key, digest_size=8, person=b"car-anchor-kid").hexdigest()


def run_digest(info: RunInfo) -> str:
    """Digest of everything a run row says (its parent, fork point, root, scenario, time, label)."""
    row = [
        info.run_id,
        info.parent_run_id,
        info.fork_seq,
        info.root_run_id,
        info.scenario,
        info.created_at,
        info.label,
    ]
    return HASH_PREFIX + hashlib.blake2b(msgspec.msgpack.encode(row), digest_size=32).hexdigest()


def _canonical(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != "mac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _mac(key: bytes, doc: dict[str, Any]) -> str:
    return MAC_ALG + ":" + hmac.new(key, _canonical(doc), hashlib.sha256).hexdigest()


def _own_marks(journal: Journal, info: RunInfo, head: int) -> list[list[Any]]:
    start = info.fork_seq or 0
    rows = journal.own_hashes(info.run_id, start)
    return [[s, h] for s, h in rows if (s + 1) % MARK_EVERY == 0 and s < head]


def make_anchor(journal: Journal, key: bytes, created_at: str) -> dict[str, Any]:
    """The anchor document of every run in the journal now."""
    runs = []
    for info in journal.runs():
        head = journal.head(info.run_id)
        runs.append(
            {
                "run_id": info.run_id,
                "head": head,
                "head_hash": journal.hash_at(info.run_id, head - 1),
                "marks": _own_marks(journal, info, head),
                "row": run_digest(info),
            }
        )
    doc: dict[str, Any] = {
        "format": FORMAT,
        "created_at": created_at,
        "key_id": key_id(key),
        "runs": runs,
    }
    doc["mac"] = _mac(key, doc)
    return doc


def write_anchor(doc: dict[str, Any], path: Path) -> None:
    """Write whole or not at all (engine/output.py); AnchorError (one line) when the target
    cannot be written."""
    from engine.output import write_whole

    try:
        write_whole(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        raise AnchorError(f"cannot write {str(path)!r}: {e.strerror or e}") from e


def read_anchor(path: str | os.PathLike[str], key: bytes) -> dict[str, Any]:
    """Load and authenticate an anchor; AnchorError unless it is intact under `key`."""
    where = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise AnchorError(f"cannot read anchor {where!r}: {e.strerror}") from e
    except ValueError as e:
        raise AnchorError(f"anchor {where!r} is not JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise AnchorError(f"anchor {where!r} is not a {FORMAT} document")
    if doc.get("key_id") != key_id(key):
        raise AnchorError(
            f"anchor {where!r} was made with another key (key id {doc.get('key_id')!r})"
        )
    if not hmac.compare_digest(str(doc.get("mac", "")), _mac(key, doc)):
        raise AnchorError(f"anchor {where!r} does not authenticate: it was altered")
    runs = doc.get("runs")
    if not isinstance(runs, list):
        raise AnchorError(f"anchor {where!r} has no runs list")
    return doc


def compare_anchor(
    journal: Journal, doc: dict[str, Any], targets: set[str]
) -> tuple[list[Any], int, list[str]]:
    """Findings of the journal against an authenticated anchor: deleted runs, altered run rows,
    truncated tails and rewritten (re-chained) history. Returns (problems, anchored, notes)."""
    from engine.verify import VerifyProblem

    problems: list[VerifyProblem] = []
    present = {info.run_id: info for info in journal.runs()}
    anchored = 0
    for entry in doc["runs"]:
        rid = str(entry["run_id"])
        if targets and rid not in targets and rid in present:
            continue
        anchored += 1
        head = int(entry["head"])
        info = present.get(rid)
        if info is None:
            problems.append(
                VerifyProblem(rid, None, f"run deleted: anchored with {head} events", "deleted")
            )
            continue
        if run_digest(info) != entry["row"]:
            problems.append(
                VerifyProblem(
                    rid, None, "run row altered (parent, fork point, label ...)", "run_row"
                )
            )
        now = journal.head(rid)
        if now < head:
            problems.append(
                VerifyProblem(
                    rid, now, f"tail truncated: anchored with {head} events, now {now}", "truncated"
                )
            )
            continue
        if _hash_or_none(journal, rid, head - 1) == entry["head_hash"]:
            continue
        first_bad = head - 1
        # a branch's marks are of its own slice: what comes before its fork point is the
        # parent's, reported at the parent
        last_good = (info.fork_seq or 0) - 1 if info.parent_run_id is not None else -1
        for seq, h in entry.get("marks", []):
            if _hash_or_none(journal, rid, int(seq)) == h:
                last_good = int(seq)
            else:
                first_bad = int(seq)
                break
        problems.append(
            VerifyProblem(
                rid,
                last_good + 1,
                f"history rewritten between seq {last_good + 1} and {first_bad}: the anchored "
                "hashes no longer match (re-chained)",
                "rechained",
            )
        )
    anchored_ids = {str(e["run_id"]) for e in doc["runs"]}
    newer = [r for r in present if r not in anchored_ids and (not targets or r in targets)]
    notes = [f"{len(newer)} runs newer than the anchor (not covered)"] if newer else []
    return problems, anchored, notes


def _hash_or_none(journal: Journal, run_id: str, seq: int) -> str | None:
    try:
        return journal.hash_at(run_id, seq)
    except JournalError:
        return None
