"""The ground truth of one heist: guards, cameras, vault, alarms and getaway routes.

A `World` is a frozen value drawn from a seed. Agents never see it: they learn its facts only
through the tools (`engine.heist.tools`), which render it as text files and a SQLite database.
The outcome function (`engine.heist.outcome`) checks a finished plan against it.

All times are minutes after midnight of the night of the job (0 = 00:00, 359 = 05:59); the
job happens between midnight and 06:00 so no window wraps around midnight.

The geometry that makes a plan checkable: the vault post is guarded all night except for one gap
[g0, g1), and the vault-corridor camera is offline for one window [c0, c1). The two overlap in
[s, e) with e - s = crack time + a few minutes of slack, so a correct plan enters at s (or a
little later), needs `crack_minutes` = dials * minutes per dial + setup, and leaves before e.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random
import re

import msgspec

# Bump when the rendering of files or tables changes, so cached folders are rebuilt.
MATERIAL_VERSION = 1

NIGHT_END = 6 * 60
VAULT_POST = "vault"
VAULT_ZONE = "vault_corridor"

_GUARD_NAMES = (
    "Ansel Brandt", "Bea Lindqvist", "Cyrus Okafor", "Dana Whitlock", "Emil Roux", "Fatima Zayed",
    "Gus Moretti", "Hana Sato", "Ivo Petrov", "Jonah Reyes", "Kira Vance", "Luis Ferreira",
    "Mara Quint", "Nils Aberg", "Orla Byrne", "Pavel Novak", "Quinn Harlow", "Rosa Delgado",
    "Silas Grey", "Tamsin Holt", "Umar Haddad", "Vera Kowalski", "Wes Tanaka", "Yara Castell",
)  # fmt: skip
_BANKS = (
    "Halvorsen Private Bank", "Merriweather Trust", "Banque Ostrand", "Castellan Savings",
    "Northgate Depository", "Vossberg & Sons", "Aldermere Bank", "Kestrel Mutual",
)  # fmt: skip
_ROUTE_NAMES = (
    "harbour_tunnel", "ring_road", "old_mill_lane", "river_bridge", "canal_street",
    "north_bypass", "market_alley", "quarry_road",
)  # fmt: skip
_VIAS = (
    "the docks", "the ring road", "the old mill", "the river bridge", "the canal",
    "the north bypass", "the market", "the quarry",
)  # fmt: skip
_VAULT_MODELS = ("Kessler KV-4", "Brandauer 900", "Lindgren Titan", "Ostrova S-12", "Marlow Apex")
_LOCK_TYPES = ("mechanical combination", "combination with relocker", "dual-wheel combination")
_VEHICLES = ("grey Skoda Octavia", "white Ford Transit", "black Audi A6", "blue VW Caddy")
_CAMERA_REASONS = ("firmware update", "lens cleaning", "scheduled maintenance", "power test")


class Guard(msgspec.Struct, frozen=True):
    """One guard's stint at one post."""

    name: str
    post: str
    shift: str
    start: int
    end: int


class Camera(msgspec.Struct, frozen=True):
    """A camera; `offline_start`/`offline_end` bound its one offline window, if any."""

    camera_id: str
    zone: str
    offline_start: int | None
    offline_end: int | None
    reason: str


class Vault(msgspec.Struct, frozen=True):
    """The vault door: opening it takes dials * minutes_per_dial + setup_minutes."""

    model: str
    lock_type: str
    dials: int
    minutes_per_dial: int
    setup_minutes: int

    @property
    def crack_minutes(self) -> int:
        return self.dials * self.minutes_per_dial + self.setup_minutes


class Alarm(msgspec.Struct, frozen=True):
    """An alarm zone and how many minutes the police need once it trips."""

    zone: str
    sensor: str
    response_minutes: int


class Route(msgspec.Struct, frozen=True):
    """A getaway route; a blocked route cannot be used at all."""

    name: str
    via: str
    status: str  # "open" | "blocked"
    drive_minutes: int


class Vehicle(msgspec.Struct, frozen=True):
    """A getaway vehicle (flavour for the driver; no plan key depends on it)."""

    plate: str
    model: str
    seats: int
    fuel_pct: int


class World(msgspec.Struct, frozen=True):
    """The ground truth of one heist, deterministic from `seed`."""

    seed: int
    bank: str
    guards: tuple[Guard, ...]
    cameras: tuple[Camera, ...]
    vault: Vault
    alarms: tuple[Alarm, ...]
    routes: tuple[Route, ...]
    vehicles: tuple[Vehicle, ...]

    def content_hash(self) -> str:
        """A hash of the world's content and of how it is rendered, with an algorithm prefix."""
        digest = hashlib.blake2b(digest_size=16)
        digest.update(f"v{MATERIAL_VERSION}:".encode())
        digest.update(msgspec.json.encode(self))
        return "b2:" + digest.hexdigest()

    def guard_gap(self) -> tuple[int, int]:
        """The one window in which no guard stands at the vault post."""
        shifts = sorted((g.start, g.end) for g in self.guards if g.post == VAULT_POST)
        for (_, end), (start, _) in itertools.pairwise(shifts):
            if start > end:
                return end, start
        raise AssertionError("a generated world always has a gap at the vault")

    def guard_at(self, post: str, minute: int) -> Guard | None:
        """The guard at `post` at `minute`, if any."""
        for g in self.guards:
            if g.post == post and g.start <= minute < g.end:
                return g
        return None

    def vault_camera(self) -> Camera:
        return next(c for c in self.cameras if c.zone == VAULT_ZONE)

    def camera_window(self) -> tuple[int, int]:
        """When the vault-corridor camera is offline."""
        cam = self.vault_camera()
        assert cam.offline_start is not None and cam.offline_end is not None
        return cam.offline_start, cam.offline_end

    def safe_window(self) -> tuple[int, int]:
        """The overlap of the guard gap and the camera window: the only time to be inside."""
        g0, g1 = self.guard_gap()
        c0, c1 = self.camera_window()
        return max(g0, c0), min(g1, c1)

    def vault_alarm(self) -> Alarm:
        return next(a for a in self.alarms if a.zone == VAULT_POST)

    def route(self, name: str) -> Route | None:
        return next((r for r in self.routes if r.name == name), None)

    def best_route(self) -> Route:
        """The fastest open route that beats the police response to the vault alarm."""
        limit = self.vault_alarm().response_minutes
        usable = [r for r in self.routes if r.status == "open" and r.drive_minutes < limit]
        return min(usable, key=lambda r: r.drive_minutes)

    def reference_plan(self) -> dict[str, str]:
        """A plan that works: what a careful crew would state for every plan key."""
        s, _ = self.safe_window()
        g0, g1 = self.guard_gap()
        c0, c1 = self.camera_window()
        return {
            "guard_gap": fmt_window(g0, g1),
            "camera_window": fmt_window(c0, c1),
            "crack_minutes": str(self.vault.crack_minutes),
            "entry_time": fmt_time(s),
            "exit_time": fmt_time(s + self.vault.crack_minutes),
            "route": self.best_route().name,
        }


def fmt_time(minutes: int) -> str:
    """Minutes after midnight as HH:MM (24h)."""
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def fmt_window(start: int, end: int) -> str:
    return f"{fmt_time(start)}-{fmt_time(end)}"


_TIME = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*$")
_WINDOW = re.compile(r"^\s*(\d{1,2}:\d{2})\s*(?:-|–|to)\s*(\d{1,2}:\d{2})\s*$")


def parse_time(text: str) -> int | None:
    """HH:MM or H:MM to minutes after midnight; None when it is not a valid time of day."""
    m = _TIME.match(text)
    if m is None:
        return None
    hours, minutes = int(m.group(1)), int(m.group(2))
    if hours > 23 or minutes > 59:
        return None
    return hours * 60 + minutes


def parse_window(text: str) -> tuple[int, int] | None:
    """'HH:MM-HH:MM' (also with an en dash or 'to') to a (start, end) pair, start < end."""
    m = _WINDOW.match(text)
    if m is None:
        return None
    start, end = parse_time(m.group(1)), parse_time(m.group(2))
    if start is None or end is None or start >= end:
        return None
    return start, end


@functools.lru_cache(maxsize=64)
def make_world(seed: int) -> World:
    """Draw the ground truth of a heist from `seed` (same seed, same world: a frozen value,
    so every branch of a run shares the one drawn for it)."""
    rng = random.Random(seed)
    names = list(_GUARD_NAMES)
    rng.shuffle(names)

    dials = rng.randint(3, 6)
    per_dial = rng.randint(5, 11)
    setup = rng.randint(2, 9)
    vault = Vault(
        model=rng.choice(_VAULT_MODELS),
        lock_type=rng.choice(_LOCK_TYPES),
        dials=dials,
        minutes_per_dial=per_dial,
        setup_minutes=setup,
    )
    crack = vault.crack_minutes
    slack = rng.randint(4, 12)
    s = rng.randint(40, 200)
    e = s + crack + slack
    lead, trail = rng.randint(3, 25), rng.randint(3, 25)
    guards_open_first = rng.random() < 0.5
    g0, c0 = (s - lead, s) if guards_open_first else (s, s - lead)
    guards_close_last = rng.random() < 0.5
    g1, c1 = (e + trail, e) if guards_close_last else (e, e + trail)

    guards = _guard_rota(rng, names, g0, g1)
    cameras = _cameras(rng, c0, c1)
    alarms, routes = _alarms_and_routes(rng)
    vehicles = tuple(
        Vehicle(
            plate=f"{rng.choice('BKMRTZ')}{rng.choice('ADEHLN')}-{rng.randint(1000, 9999)}",
            model=model,
            seats=rng.choice((4, 5, 7)),
            fuel_pct=rng.randint(35, 100),
        )
        for model in rng.sample(_VEHICLES, 2)
    )
    return World(
        seed=seed,
        bank=rng.choice(_BANKS),
        guards=guards,
        cameras=cameras,
        vault=vault,
        alarms=alarms,
        routes=routes,
        vehicles=vehicles,
    )


def _split(rng: random.Random, start: int, end: int) -> list[tuple[int, int]]:
    """Cover [start, end) with one or two consecutive stints."""
    if end - start >= 60 and rng.random() < 0.6:
        cut = rng.randint(start + 20, end - 20)
        return [(start, cut), (cut, end)]
    return [(start, end)]


def _guard_rota(rng: random.Random, names: list[str], g0: int, g1: int) -> tuple[Guard, ...]:
    stints: list[tuple[str, int, int]] = []
    stints += [(VAULT_POST, a, b) for a, b in _split(rng, 0, g0)]
    stints += [(VAULT_POST, a, b) for a, b in _split(rng, g1, NIGHT_END)]
    for post in ("lobby", "control_room"):
        stints += [(post, a, b) for a, b in _split(rng, 0, NIGHT_END)]
    # The loading dock also has a gap, so that "the first gap in the table" is not the answer.
    d0 = rng.randint(30, 240)
    d1 = d0 + rng.randint(20, 60)
    stints += [("loading_dock", 0, d0), ("loading_dock", d1, NIGHT_END)]
    guards = [
        Guard(name=names[i], post=post, shift="night", start=a, end=b)
        for i, (post, a, b) in enumerate(stints)
    ]
    day = len(stints)
    guards += [
        Guard(name=names[day], post=VAULT_POST, shift="day", start=360, end=840),
        Guard(name=names[day + 1], post="lobby", shift="day", start=360, end=840),
    ]
    rng.shuffle(guards)
    return tuple(guards)


def _cameras(rng: random.Random, c0: int, c1: int) -> tuple[Camera, ...]:
    ids = rng.sample(range(1, 20), 5)
    dock0 = rng.randint(60, 280)
    cams = [
        Camera(f"cam-{ids[0]:02d}", "lobby", None, None, "always on"),
        Camera(f"cam-{ids[1]:02d}", VAULT_ZONE, c0, c1, rng.choice(_CAMERA_REASONS)),
        Camera(f"cam-{ids[2]:02d}", "loading_dock", dock0, dock0 + rng.randint(15, 45),
               rng.choice(_CAMERA_REASONS)),
        Camera(f"cam-{ids[3]:02d}", "stairwell", None, None, "always on"),
        Camera(f"cam-{ids[4]:02d}", "roof", None, None, "always on"),
    ]  # fmt: skip
    rng.shuffle(cams)
    return tuple(cams)


def _alarms_and_routes(rng: random.Random) -> tuple[tuple[Alarm, ...], tuple[Route, ...]]:
    response = rng.randint(9, 16)
    alarms = (
        Alarm(VAULT_POST, "seismic", response),
        Alarm("lobby", "motion", rng.randint(5, 9)),
        Alarm("loading_dock", "door contact", rng.randint(6, 12)),
        Alarm("roof", "hatch contact", rng.randint(8, 14)),
    )
    good = response - rng.randint(1, 4)
    # Exactly one route is usable: a faster one is blocked, the others are too slow.
    drives = [
        ("open", good),
        ("blocked", good - rng.randint(1, 4)),
        ("open", response + rng.randint(1, 5)),
        (rng.choice(("open", "blocked")), response + rng.randint(6, 12)),
    ]
    picks = rng.sample(range(len(_ROUTE_NAMES)), len(drives))
    routes = [
        Route(name=_ROUTE_NAMES[i], via=_VIAS[i], status=status, drive_minutes=minutes)
        for i, (status, minutes) in zip(picks, drives, strict=True)
    ]
    rng.shuffle(routes)
    return alarms, tuple(routes)


def world_files(world: World) -> dict[str, str]:
    """The text files the file reader serves, by name."""
    v = world.vault
    cams = sorted(world.cameras, key=lambda c: c.camera_id)
    cam_lines = [
        f"{c.camera_id}  {c.zone:<14} "
        + (
            f"offline {fmt_window(c.offline_start, c.offline_end)} ({c.reason})"
            if c.offline_start is not None and c.offline_end is not None
            else "always on"
        )
        for c in cams
    ]
    routes = sorted(world.routes, key=lambda r: r.name)
    route_lines = [
        f"{r.name:<14} via {r.via:<18} {r.drive_minutes} min drive  "
        + ("OPEN" if r.status == "open" else "BLOCKED (roadworks)")
        for r in routes
    ]
    vault_cam = world.vault_camera().camera_id
    return {
        "vault_specs.txt": "\n".join(
            [
                f"VAULT SPECIFICATION - {world.bank}",
                f"Model: {v.model}",
                f"Lock type: {v.lock_type}",
                f"Dials: {v.dials}",
                f"Minutes per dial (experienced safecracker): {v.minutes_per_dial}",
                f"Setup before the first dial (drill jig, stethoscope): {v.setup_minutes} minutes",
                "Door weight: 4.2 t; hinges on the left",
                "Note: the door cannot be forced; every dial must be worked in turn.",
                "",
            ]
        ),
        "camera_schedule.txt": "\n".join(
            ["CAMERA SCHEDULE - night of the job (times 24h)", *cam_lines, ""]
        ),
        "building_layout.txt": "\n".join(
            [
                f"BUILDING LAYOUT - {world.bank}",
                "Ground floor: lobby (guard post 'lobby'), counters, control_room (guard post)",
                f"Basement: vault_corridor (camera {vault_cam}), vault (guard post 'vault')",
                "Rear: loading_dock (guard post 'loading_dock'), staff exit to the yard",
                "Roof: access hatch, stairwell down to the basement",
                "Guard rota and alarm response times are kept in the security database.",
                "",
            ]
        ),
        "routes.txt": "\n".join(
            ["GETAWAY ROUTES - traffic bulletin for the night", *route_lines, ""]
        ),
    }


def world_tables(world: World) -> dict[str, tuple[tuple[str, ...], list[tuple[object, ...]]]]:
    """The security database: table name -> (column names, rows). Times are 'HH:MM' text."""
    return {
        "guards": (
            ("name", "post", "shift", "start_time", "end_time"),
            [(g.name, g.post, g.shift, fmt_time(g.start), fmt_time(g.end)) for g in world.guards],
        ),
        "cameras": (
            ("camera_id", "zone", "status", "offline_start", "offline_end"),
            [
                (
                    c.camera_id,
                    c.zone,
                    "always on" if c.offline_start is None else c.reason,
                    None if c.offline_start is None else fmt_time(c.offline_start),
                    None if c.offline_end is None else fmt_time(c.offline_end),
                )
                for c in world.cameras
            ],
        ),
        "alarms": (
            ("zone", "sensor", "response_minutes"),
            [(a.zone, a.sensor, a.response_minutes) for a in world.alarms],
        ),
        "routes": (
            ("name", "via", "status", "drive_minutes"),
            [(r.name, r.via, r.status, r.drive_minutes) for r in world.routes],
        ),
        "vehicles": (
            ("plate", "model", "seats", "fuel_pct"),
            [(v.plate, v.model, v.seats, v.fuel_pct) for v in world.vehicles],
        ),
    }
