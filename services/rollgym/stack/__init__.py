"""Operating a stack: the local launcher, one server process, Ray actors, docker compose."""
