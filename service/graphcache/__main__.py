"""`python -m graphcache` = the `graphcache` command."""

from graphcache.cli import main

if __name__ == "__main__":
    main()
