"""Caller authentication (API keys, JWTs), per-principal grants and rate limits for the router."""
