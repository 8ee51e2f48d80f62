#!/usr/bin/env bash
# Puts Debian's OpenSSH server and rsync (what `ray up` needs on each host: sshd to log in, rsync
# for its file mounts) under .cache/sshd/ without installing them system-wide: the bed of hosts
# (scripts/hosts.sh up N --ssh KEY.pub) runs an sshd on each host's address. Prints the
# directory of the commands (sshd, rsync: small wrappers that find their libraries there).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=$PWD/.cache/sshd
if [ ! -x "$dest/bin/sshd" ] || [ ! -x "$dest/bin/rsync" ]; then
  tmp=$(mktemp -d) && chmod 777 "$tmp"  # apt downloads as its own user
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && apt-get download -q openssh-server openssh-sftp-server rsync libwrap0 libpopt0 >/dev/null)
  rm -rf "$dest" && mkdir -p "$dest/bin"
  for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$dest/root"; done
  libs="$dest/root/usr/lib/x86_64-linux-gnu:$dest/root/lib/x86_64-linux-gnu"
  # sshd re-executes itself by its full path: the wrapper runs it with its libraries on the path
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$libs" "$dest/root/usr/sbin/sshd" > "$dest/bin/sshd"
  printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$libs" "$dest/root/usr/bin/rsync" > "$dest/bin/rsync"
  chmod +x "$dest/bin/sshd" "$dest/bin/rsync"
fi
"$dest/bin/rsync" --version >/dev/null
echo "$dest/bin"
