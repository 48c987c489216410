"""One merged trace for a world: recording every worker, merging, drawing."""
