"""The build's last stage: the manifest (manifest), the artifact directory written from a cache
entry (artifact), and, with --kernels, compiled kernels added to both (kernels)."""
