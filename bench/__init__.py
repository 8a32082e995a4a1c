"""Benchmarks of django-leases against its database-backed peers (not part of the package)."""
