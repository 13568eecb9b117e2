"""Migration revisions, one file each, named after their revision id."""
