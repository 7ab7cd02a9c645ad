"""Executables ready before they are needed: the standby compiler and the compile worker process."""
