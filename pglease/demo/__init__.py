"""`pglease demo`: a small fleet of real host processes contending for resources."""
