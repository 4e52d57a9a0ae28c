"""sfsync's start-up folder (sitecustomize.py): see sfsync/follow_boot.py."""
