"""pdserve.router: the OpenAI-compatible HTTP front (app.py; docs/architecture.md)."""
