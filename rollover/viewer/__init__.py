"""`rollover view RUN_DIR`: a read-only web page over a run folder (see app.py)."""
