"""Lab hosts for the controller: Debian rootfs, systemd-nspawn machines in network namespaces,
the local wheelhouse, the lab's host list."""
