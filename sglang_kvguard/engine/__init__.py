"""The patch engine: manifests, fingerprints, guards and their installation."""
