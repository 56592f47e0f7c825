"""``splitstream-shipper``: ship the routers' write-ahead logs to the recorder."""
