"""What the driver, the executors and the engine share, and nothing else: wire messages, the rank spec,
the flight-recorder file format, process lifetime and process helpers, the emulated cluster network
(netemu: driver, chaos and diagnostics). Imports nothing else of megascale."""
