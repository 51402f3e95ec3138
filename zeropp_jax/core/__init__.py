"""What the user chose and the run's environment: config, the (node, local) mesh, version-dependent JAX calls, cross-process agreement."""
