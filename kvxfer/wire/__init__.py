"""The wire: kvxfer's types as protobuf messages (``codec``) and errors as rich gRPC status
(``status``). Nothing else in kvxfer touches protobuf messages."""
