"""The ``dataset`` config group: loaders that normalise every source into the data contract (``contract``).

Layer 2: imports only the foundation and ``runs``; data never imports models, features or methods."""
