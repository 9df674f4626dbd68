"""Replay one rank alone, verify it bit for bit, and find where runs diverged."""
