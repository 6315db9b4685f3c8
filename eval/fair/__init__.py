"""The fair study's machinery below trainer/: the speedup statistics, the search spaces and reading
them from config, the coordinate-descent tuner, and the records a study writes and reports from."""
