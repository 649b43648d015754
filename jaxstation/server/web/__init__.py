"""The chat page served at `/` (page.py) and its static files (static/)."""
