"""The detection server and live dashboard (`car serve`): FastAPI on the journal."""

from engine.server.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
