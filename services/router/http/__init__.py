"""The router's HTTP front door (OpenAI-compatible API): see :mod:`splitstream.router.http.app`."""
