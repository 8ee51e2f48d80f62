#!/usr/bin/env bash
# A bed of hosts on this machine, for trying a cluster of several hosts (root only):
#
#   bash scripts/hosts.sh up 3 [--name NAME] [--ssh KEY.pub]   # hosts h1..h3; prints "hN ADDRESS" per host
#   bash scripts/hosts.sh run [--name NAME] h2 -- ray start --address=10.231.0.2:6379 ...
#   bash scripts/hosts.sh down [--name NAME]   # stops every process the bed's hosts run, removes it all
#   bash scripts/hosts.sh list                 # the beds that are up
#   bash scripts/hosts.sh crash [--name NAME] h2   # h2 loses its power: cable out, every process killed
#   bash scripts/hosts.sh boot [--name NAME] h2    # h2 is back: cable in, nothing running
#   bash scripts/hosts.sh impair [--name NAME] h2 DELAY_MS LOSS   # h2's link: DELAY_MS each way, LOSS (0..1)
#   bash scripts/hosts.sh mend [--name NAME] h2    # h2's link whole again
#
# Each host has what a real host has apart from its disk: its own network namespace (its own
# loopback, and one address on a bridge that only the bed's hosts and this machine share), its own
# mount namespace (its own /tmp and /dev/shm, so Ray's session files and shared memory are its
# own), its own PID, IPC and UTS namespaces (`ray stop` on a host stops that host's Ray only; its
# hostname is hN). Everything else (the repository, the virtual environment, $HOME) is this
# machine's, as a shared file system would give it; a directory of this machine's /tmp that the
# hosts must still see (a checkout or a virtual environment there) is kept: the repository always,
# others with `up N --keep DIR` (repeatable). This machine reaches the hosts at their
# addresses (it is .1 on the bridge); the bridge itself lives in a namespace of the bed's own, so
# nothing is added to this machine's network but that one link, and nothing leaves the bed.
#
# With --ssh KEY.pub each host is also what `ray up` logs into: an sshd on the host's address (port 22;
# Debian's, from scripts/install_sshd.sh) that lets root in with that key, and root's own home
# (/home/root, the host's own disk, empty but for a Python virtual environment that sees this
# machine's .venv packages, as a machine image with Python and Ray would: its `pip install` goes into
# the host's environment, never into .venv, and fetches nothing (no index: nothing leaves the bed)).
#
# A host is one process (its namespaces' init); `down` kills it, and the kernel ends every process
# of that host with it. `crash` is a host's power lost: its link goes down first (its peers get
# no answer, as from a dead machine, not a refused connection), then every process of the host but
# its init is killed, and Ray's session files and the host's shared memory are gone; `boot` brings
# the link back, and what the host runs (Ray, sshd) is started again by whoever started it first.
# Two beds can be up at once (each with its own NAME and subnet).
#
# `impair` cuts a host's link in two at the bridge and relays its frames in user space with that
# delay and loss (scripts/netem.py: what netem does, for kernels without sch_netem), its senders set
# to one TCP segment a frame so that a loss is one segment's; `mend` puts the cable back as it was.
set -euo pipefail

STATE=/run/pdserve-hosts
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "hosts.sh: $*" >&2; exit 1; }

cmd=${1:-}; [ -n "$cmd" ] || usage; shift
name=pdbed
ssh_key=""
args=()
keep=("$(cd "$(dirname "$0")/.." && pwd)")
while [ $# -gt 0 ]; do
    case "$1" in
        --name) name=$2; shift 2 ;;
        --keep) keep+=("$(cd "$2" && pwd)"); shift 2 ;;
        --ssh) ssh_key=$(readlink -f "$2"); [ -s "$ssh_key" ] || die "--ssh $2: no such public key"; shift 2 ;;
        --) args+=("$@"); break ;;
        *) args+=("$1"); shift ;;
    esac
done
[[ "$name" =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "--name must be 1-8 lowercase letters or digits, got '$name'"
dir=$STATE/$name

host_pid() {  # the host's init, as this machine sees it
    local f=$dir/$1.pid
    [ -s "$f" ] || die "no host $1 in bed $name (hosts: $(cd "$dir" 2>/dev/null && ls ./*.pid 2>/dev/null | xargs -n1 basename | sed 's/\.pid//' | tr '\n' ' '))"
    cat "$f"
}

up() {
    local n=${args[0]:-}
    [[ "$n" =~ ^[1-9][0-9]*$ ]] && [ "$n" -le 200 ] || die "up N: N must be 1..200 hosts, got '${n}'"
    [ "$(id -u)" = 0 ] || die "the bed makes namespaces and a bridge: run it as root"
    mkdir -p "$STATE"
    [ -e "$dir" ] && die "bed '$name' is up already (down it first: bash scripts/hosts.sh down --name $name)"
    # a subnet no other bed holds: 10.231.K.0/24
    local k
    exec 9>"$STATE/.lock"
    flock 9
    for k in $(seq 0 255); do
        grep -qx "10.231.$k" "$STATE"/*/subnet 2>/dev/null || break
    done
    mkdir -p "$dir"
    echo "10.231.$k" > "$dir/subnet"
    flock -u 9
    local net=10.231.$k sw=$name-sw
    trap 'echo "hosts.sh: up failed; removing what it made" >&2; down_bed' ERR
    ip netns add "$sw"
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    # this machine's own link into the bed: $name-0 here, p0 on the bridge
    ip -n "$sw" link add p0 type veth peer name "$name-0"
    ip -n "$sw" link set "$name-0" netns $$
    ip -n "$sw" link set p0 master br0 up
    ip addr add "$net.1/24" dev "$name-0"
    ip link set "$name-0" up
    # what of this machine's /tmp and /dev/shm the hosts keep seeing: bound aside before the host's own
    # tmpfs covers them, then bound back at the same path (all inside the host's mount namespace)
    local pre="" post="" j=0 k
    for k in "${keep[@]}"; do
        case "$k" in
            /tmp/*|/dev/shm/*)
                j=$((j + 1))
                mkdir -p "$dir/keep$j"
                pre+="mount --bind '$k' '$dir/keep$j' && "
                post+=" && mkdir -p '$k' && mount --bind '$dir/keep$j' '$k' && umount '$dir/keep$j'" ;;
        esac
    done
    local i ns addr holder child
    for i in $(seq 1 "$n"); do
        ns=$name-h$i addr=$net.$((i + 1))
        ip netns add "$ns"
        ip -n "$sw" link add "p$i" type veth peer name eth0 netns "$ns"
        ip -n "$sw" link set "p$i" master br0 up
        ip -n "$ns" link set lo up
        ip -n "$ns" addr add "$addr/24" dev eth0
        ip -n "$ns" link set eth0 up
        # the host's init: new PID, mount, IPC and UTS namespaces inside its network namespace;
        # its own /tmp and /dev/shm; it reaps what ends under it and waits to be killed
        ip netns exec "$ns" unshare --pid --mount --ipc --uts --fork --mount-proc --propagation private \
            bash -c "${pre}mount -t tmpfs -o mode=1777 tmpfs /tmp && mount -t tmpfs -o mode=1777 tmpfs /dev/shm \
                     $post && hostname h$i && exec -a pdserve-host-$name-h$i bash -c 'trap \"\" TERM INT HUP; \
                     while :; do sleep 3600 & wait \$! || true; done'" </dev/null >/dev/null 2>&1 &
        holder=$!
        child=""
        for _ in $(seq 1 100); do
            child=$(cat "/proc/$holder/task/$holder/children" 2>/dev/null | awk '{print $1}')
            [ -n "$child" ] && [ "$(readlink "/proc/$child/ns/uts")" != "$(readlink /proc/self/ns/uts)" ] \
                && [ "$(nsenter -t "$child" --uts hostname 2>/dev/null)" = "h$i" ] && break
            child=""
            sleep 0.05
        done
        [ -n "$child" ] || die "host h$i did not start"
        echo "$child" > "$dir/h$i.pid"
        echo "$addr" > "$dir/h$i.addr"
        if [ -n "$ssh_key" ]; then ssh_host "$child" "$addr" || die "host h$i: its sshd did not start"; fi
        echo "h$i $addr"
    done
    trap - ERR
}

ssh_host() {  # a host's sshd on its address, root's own home and Python environment (--ssh)
    local pid=$1 addr=$2 tools repo=${keep[0]}
    tools=$(bash "$repo/scripts/install_sshd.sh")
    [ -x "$repo/.venv/bin/python" ] || die "--ssh: the hosts' Python environment builds on $repo/.venv: make it first"
    local base site key
    key=$(cat "$ssh_key")
    base=$("$repo/.venv/bin/python" -c 'import sys; print(sys.base_prefix)')
    site=$("$repo/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    nsenter -t "$pid" --net --mount --pid --ipc --uts -- bash -euc "
        mount -t tmpfs -o mode=755 tmpfs /home && mount -t tmpfs -o mode=755 tmpfs /run
        mkdir -p /run/sshd /home/root/.ssh && chmod 700 /home/root /home/root/.ssh
        # root's home is the host's own; sshd's privilege separation has its user
        sed 's#^root:\([^:]*\):0:0:\([^:]*\):[^:]*:#root:\1:0:0:\2:/home/root:#' /etc/passwd > /run/passwd
        grep -q '^sshd:' /run/passwd || echo 'sshd:x:74:65534::/run/sshd:/usr/sbin/nologin' >> /run/passwd
        mount --bind /run/passwd /etc/passwd
        echo '$key' > /home/root/.ssh/authorized_keys
        '$base/bin/python3' -m venv --without-pip /home/root/venv
        echo '$site' > \$(/home/root/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')/host-image.pth
        # the image's commands: pip and ray of those packages, run by the host's own Python
        printf '#!/home/root/venv/bin/python\nimport sys\nfrom pip._internal.cli.main import main\nsys.exit(main())\n' > /home/root/venv/bin/pip
        printf '#!/home/root/venv/bin/python\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n' > /home/root/venv/bin/ray
        chmod +x /home/root/venv/bin/pip /home/root/venv/bin/ray
        mkdir -p /home/root/.config/pip
        printf '[global]\nno-index = true\n[install]\nno-build-isolation = false\n' > /home/root/.config/pip/pip.conf
        echo 'export PATH=/home/root/venv/bin:$tools:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin' > /home/root/.bashrc
        cp /home/root/.bashrc /home/root/.profile
        echo 'PATH=/home/root/venv/bin:$tools:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin' > /home/root/.ssh/environment
        ssh-keygen -q -t ed25519 -N '' -f /run/ssh_host_ed25519_key
        printf '%s\n' 'ListenAddress $addr' 'HostKey /run/ssh_host_ed25519_key' 'PidFile /run/sshd.pid' \
            'PermitRootLogin prohibit-password' 'PasswordAuthentication no' 'KbdInteractiveAuthentication no' \
            'UsePAM no' 'PermitUserEnvironment yes' 'Subsystem sftp internal-sftp' 'MaxStartups 100' \
            'MaxSessions 100' > /run/sshd_config
        '$tools/sshd' -f /run/sshd_config -E /run/sshd.log
    " </dev/null >/dev/null
}

down_bed() {
    [ -d "$dir" ] || return 0
    local f pid
    for f in "$dir"/*.netem; do  # the relays of impaired links
        [ -e "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
    done
    for f in "$dir"/*.pid; do
        [ -e "$f" ] || continue
        pid=$(cat "$f")
        # PID 1 of the host's namespace: its death ends every process of the host
        [ -d "/proc/$pid" ] && kill -9 "$pid" 2>/dev/null || true
    done
    for f in "$dir"/*.pid; do
        [ -e "$f" ] || continue
        pid=$(cat "$f")
        for _ in $(seq 1 100); do [ -d "/proc/$pid" ] || break; sleep 0.05; done
    done
    local ns
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$name-(h[0-9]+|sw)$" || true); do
        ip netns del "$ns" 2>/dev/null || true
    done
    ip link del "$name-0" 2>/dev/null || true
    rm -rf "$dir"
}

case "$cmd" in
    up) up ;;
    down) down_bed ;;
    run)
        [ ${#args[@]} -ge 1 ] || usage
        host=${args[0]}; pid=$(host_pid "$host")
        rest=("${args[@]:1}"); [ "${rest[0]:-}" = "--" ] && rest=("${rest[@]:1}")
        [ ${#rest[@]} -ge 1 ] || usage
        exec nsenter -t "$pid" --net --mount --pid --ipc --uts --wd="$PWD" -- "${rest[@]}" ;;
    crash|boot)
        [ ${#args[@]} -eq 1 ] || usage
        pid=$(host_pid "${args[0]}")
        if [ "$cmd" = crash ]; then
            nsenter -t "$pid" --net -- ip link set eth0 down
            # kill -1 from inside the host's PID namespace: every process of it but its init and this shell
            nsenter -t "$pid" --net --mount --pid --ipc --uts -- bash -c \
                'kill -9 -1 2>/dev/null; sleep 0.2; rm -rf /tmp/ray; find /dev/shm -xdev -mindepth 1 -delete 2>/dev/null; true'
        else
            nsenter -t "$pid" --net -- ip link set eth0 up
        fi ;;
    impair)
        [ ${#args[@]} -eq 3 ] || usage
        pid=$(host_pid "${args[0]}"); i=${args[0]#h}; sw=$name-sw
        [ -e "$dir/h$i.netem" ] && die "${args[0]}'s link is impaired already (mend it first)"
        # p$i (the host's cable at the bridge) leaves the bridge; q$i/r$i take its place, the relay between
        ip -n "$sw" link set "p$i" nomaster
        ip -n "$sw" link add "q$i" type veth peer name "r$i"
        ip -n "$sw" link set "q$i" master br0 up
        for l in "p$i" "r$i"; do ip -n "$sw" link set "$l" promisc on up; done
        for l in "q$i" "r$i" "p$i"; do ip -n "$sw" link set "$l" gso_max_segs 1; done
        nsenter -t "$pid" --net -- ip link set eth0 gso_max_segs 1
        repo=${keep[0]}
        ip netns exec "$sw" "${PYTHON:-python3}" "$repo/scripts/netem.py" "p$i" "r$i" --delay-ms "${args[1]}" \
            --loss "${args[2]}" > "$dir/h$i.netem.log" 2>&1 &
        echo $! > "$dir/h$i.netem"
        for _ in $(seq 1 100); do grep -q relaying "$dir/h$i.netem.log" 2>/dev/null && break; sleep 0.05; done
        grep -q relaying "$dir/h$i.netem.log" || { cat "$dir/h$i.netem.log" >&2; die "the relay did not start"; } ;;
    mend)
        [ ${#args[@]} -eq 1 ] || usage
        pid=$(host_pid "${args[0]}"); i=${args[0]#h}; sw=$name-sw
        [ -e "$dir/h$i.netem" ] || exit 0
        kill "$(cat "$dir/h$i.netem")" 2>/dev/null || true
        ip -n "$sw" link del "q$i" 2>/dev/null || true
        ip -n "$sw" link set "p$i" promisc off master br0 up
        ip -n "$sw" link set "p$i" gso_max_segs 65535
        nsenter -t "$pid" --net -- ip link set eth0 gso_max_segs 65535
        rm -f "$dir/h$i.netem" "$dir/h$i.netem.log" ;;
    addr) cat "$dir/${args[0]}.addr" ;;
    list) for d in "$STATE"/*/; do [ -d "$d" ] && echo "$(basename "$d") $(cat "$d/subnet").0/24"; done; true ;;
    *) usage ;;
esac
