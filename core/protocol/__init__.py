"""What ranks and node agents say to each other and to the supervisor: the messages on a node's hub
(telemetry) and how a hub knows who is dialling it (access)."""
