"""The training methods: the Method interface, the method table, one module per method."""
