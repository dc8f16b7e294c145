"""The build's first stage: user choices validated into a BuildSpec (build_spec), the layout
checked against the model (layout), and the cache key's named factors (cache_key)."""
