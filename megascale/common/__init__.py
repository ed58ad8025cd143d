"""What the driver, the executors and the engine share, and nothing else: wire messages, the rank spec,
the flight-recorder file format, process lifetime and process helpers. Imports nothing else of megascale."""
