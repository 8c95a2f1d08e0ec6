"""The HTTP process: the Litestar app (`api.app`), authentication, the envelope and the one
error mapping, the gate and event endpoints. It decodes, validates and authenticates each
request, then sends its op to the writer process (`writer.ops`) and answers after the
writer's commit."""
