"""Several processes, one station (multi-controller JAX): the leader that serves HTTP and sends every step call to
its followers (`process_group`), and the binary payload format those calls travel in, which the mesh speaks too
(`payload`)."""
