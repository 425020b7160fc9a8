"""Task families (filled in by the edit-evaluation work; each registers with @register_family)."""
