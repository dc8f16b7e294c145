"""Every content-addressed store titan keeps under $TITAN_CACHE_DIR, on one mechanism: blobs by
sha256 and signed records (content_store, signing), one lock per key (lock). The build cache
(build_cache) and the compiled-kernel store (kernel_store) are two users of it."""
