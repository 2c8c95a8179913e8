//go:build linux

package server

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// Netns names a network namespace by its nsfs inode (device and inode of
// /proc/PID/ns/net, or of a bind mount of it such as /run/netns/NAME):
// two of them are one namespace exactly when these are equal.
type Netns struct{ Dev, Ino uint64 }

// NetnsOf returns the namespace that path (a netns file) names.
func NetnsOf(path string) (Netns, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return Netns{}, fmt.Errorf("netns %s: %w", path, err)
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(path, &fs); err != nil || fs.Type != unix.NSFS_MAGIC || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return Netns{}, fmt.Errorf("netns %s: not a namespace file (want /run/netns/NAME or /proc/PID/ns/net)", path)
	}
	return Netns{st.Dev, st.Ino}, nil
}

func netnsOfFd(fd int) (Netns, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return Netns{}, err
	}
	return Netns{st.Dev, st.Ino}, nil
}

// errNotGuest wraps every refusal of PeerIn, so that callers tell "not
// this guest's" from "cannot tell".
var errNotGuest = errors.New("not the guest's")

// PeerIn checks that the process at the other end of c, a connection
// accepted on a Unix socket, is in network namespace want: it is then one
// of the guest's processes, whatever its uid or root directory. This is
// the one check hostd makes of a process or container guest's control
// connection on a socket anyone may open (Endpoint.Netns); the
// containers' run-time guests use it too.
//
// Races: the process is named by a pidfd, never by its pid alone, so a pid
// reused meanwhile cannot stand in for it: SO_PEERPIDFD (Linux 6.5) gives
// the pidfd of the process that called connect, and PIDFD_GET_NET_NAMESPACE
// (6.11) its namespace now. On older kernels the pid from SO_PEERCRED is
// opened as a pidfd first, /proc/PID/ns/net read next, and the pidfd asked
// afterwards whether that process still lives: if it does, the namespace
// read was its. What is checked is where the connecting process is at
// accept time. A guest's process that hands its connected socket to a
// process elsewhere lends its own session, as it could relay for it
// anyway: the session stays the guest's, and acts only for it.
func PeerIn(c net.Conn, want Netns) error {
	got, cred, err := PeerNetns(c)
	if err != nil {
		return err
	}
	if got != want {
		return fmt.Errorf("pid %d (%s, uid %d) is in another network namespace (inode %d, the guest's is %d): %w",
			cred.Pid, comm(int(cred.Pid)), cred.Uid, got.Ino, want.Ino, errNotGuest)
	}
	return nil
}

// PeerNetns returns the network namespace of the process at the other end
// of c, and its credentials, as PeerIn reads them: the container socket
// serves the run-time guest of that namespace.
func PeerNetns(c net.Conn) (Netns, *unix.Ucred, error) {
	uc, ok := c.(*net.UnixConn)
	if !ok {
		return Netns{}, nil, fmt.Errorf("control connection %T is not a Unix socket", c)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return Netns{}, nil, err
	}
	var cred *unix.Ucred
	pidfd, credErr, pidfdErr := -1, error(nil), error(nil)
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
		pidfd, pidfdErr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PEERPIDFD)
	}); err != nil {
		return Netns{}, nil, err
	}
	if credErr != nil {
		return Netns{}, nil, fmt.Errorf("peer credentials: %w", credErr)
	}
	if pidfdErr != nil || pidfd < 0 {
		if pidfd, err = unix.PidfdOpen(int(cred.Pid), 0); err != nil {
			return Netns{}, nil, fmt.Errorf("pid %d: %w (it exited)", cred.Pid, errNotGuest)
		}
	}
	defer unix.Close(pidfd)
	got, err := peerNetns(pidfd, int(cred.Pid))
	if err != nil {
		return Netns{}, nil, fmt.Errorf("pid %d: its network namespace: %w", cred.Pid, err)
	}
	return got, cred, nil
}

// peerNetns returns the network namespace of the process pidfd names.
func peerNetns(pidfd, pid int) (Netns, error) {
	if nsfd, err := unix.IoctlRetInt(pidfd, unix.PIDFD_GET_NET_NAMESPACE); err == nil {
		defer unix.Close(nsfd)
		return netnsOfFd(nsfd)
	} else if errors.Is(err, unix.ESRCH) {
		return Netns{}, fmt.Errorf("%w (it exited)", errNotGuest)
	}
	ns, err := NetnsOf(fmt.Sprintf("/proc/%d/ns/net", pid))
	if err != nil {
		return Netns{}, err
	}
	// Still alive after the read: the pid was not reused meanwhile.
	if err := unix.PidfdSendSignal(pidfd, 0, nil, 0); err != nil {
		return Netns{}, fmt.Errorf("%w (it exited)", errNotGuest)
	}
	return ns, nil
}

// comm is a process's command name, for messages ("?" if it is gone).
func comm(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	if err != nil {
		return "?"
	}
	return strings.TrimSpace(string(b))
}
