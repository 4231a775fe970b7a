# No packages.
