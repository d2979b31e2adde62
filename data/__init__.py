"""Getting FineWeb as token shards (fineweb.py) and their format (shards.py)."""
