"""The recorder: receives call records from routers, redacts them and writes them to Redis Streams."""
