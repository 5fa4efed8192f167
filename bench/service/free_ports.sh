# Sourced by the service scripts: `free_ports N` prints N distinct free TCP ports on 127.0.0.1, all bound at
# once so the kernel cannot hand the same one out twice (two listeners on one port: the server refuses to start).
free_ports() {
  python3 -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}
