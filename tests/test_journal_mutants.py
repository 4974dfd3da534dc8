"""The journal's smaller promises, each pinned where a changed line would go unnoticed
elsewhere: error messages that name what is wrong, redaction, lineage and snapshot bounds."""

from __future__ import annotations
