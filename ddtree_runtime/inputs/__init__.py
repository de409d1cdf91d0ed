"""The rules for operator input and systemd's quoting (the roles reach them through
ansible/filter_plugins/). Imports only `core`."""
