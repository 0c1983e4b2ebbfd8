"""The engine replicas seen from the client: connecting to Ray, placement groups, starting the driver
actors of data-parallel replicas and failing over between them."""
