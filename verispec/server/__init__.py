"""OpenAI-compatible HTTP server with speculation statistics, Prometheus metrics and a live page."""

from verispec.server.app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]
