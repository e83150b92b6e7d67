# tunnel reattach: runs in /bin/sh after common.sh; session.sh follows.
# A client that lost its connection (or detached) comes back to the server
# whose runtime directory is TUNNEL_RT. Nothing secret travels: the client
# still holds the token.
gone() {
  say "error gone $*"
  exit 1
}
case $rt in
  */tunnel-jupyter.*) ;;
  *) gone "$rt is not a tunnel runtime directory" ;;
esac
[ -d "$rt" ] && [ -O "$rt" ] || gone "the server is gone ($rt no longer exists)"
[ -e "$rt/stopping" ] && gone "the server is stopping"
[ -s "$rt/jupyter.exit" ] && gone "jupyter has exited (status $(cat "$rt/jupyter.exit"))"
jp=
read -r jp <"$rt/jupyter.pid" 2>/dev/null
{ [ -n "$jp" ] && kill -0 "$jp" 2>/dev/null; } || gone "jupyter (pid ${jp:-?}) is no longer running"
port=
base=
read -r port base <"$rt/ready" 2>/dev/null
[ -n "$port" ] || gone "the server never became ready"
# Kept for a detached client; this client says again if it wants that.
rm -f "$rt/keep"
say "pid $jp"
say "ready $port ${base:-/}"
