"""A call's arguments."""
