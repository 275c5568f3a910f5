"""The warm server process (server): forks ranks, reaps them, and dies with the
launching process. It never runs user code; its forked children become ranks."""
