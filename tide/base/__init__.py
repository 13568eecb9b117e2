"""The base both the services and the trainer stand on.

Nothing here imports SQLAlchemy, Kubernetes, Paddle or any ``tide.services`` module,
so a Paddle worker and a control-plane service can share it: the error
hierarchy and its gRPC mapping, channel options and the client channel,
protobuf time conversion, reconnect backoff, lifecycle tables and the
``LISTENING`` start-up line.
"""
