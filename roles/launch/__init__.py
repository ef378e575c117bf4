"""How a job's processes are placed and supervised: launchers behind one seam (local processes today)."""
