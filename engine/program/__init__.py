"""Recorded programs: any program on an OpenAI-compatible API, recorded through a local proxy
and replayed, forked and attributed like a heist (see engine/program/session.py)."""
