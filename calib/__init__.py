"""s2moe calibration toolkit: measures a device and writes the profile `s2moe run` consumes."""
