"""``splitstream-replay``: re-send recorded calls to a router or a worker, diff the answers, gate CI on them."""
