//go:build !linux

package server

import (
	"errors"
	"net"
)

// Netns names a network namespace (Linux only).
type Netns struct{ Dev, Ino uint64 }

var errNoNetns = errors.New("network namespaces are Linux only")

// NetnsOf is Linux only.
func NetnsOf(path string) (Netns, error) { return Netns{}, errNoNetns }

// PeerNetns is Linux only.
func PeerNetns(c net.Conn) (Netns, *Ucred, error) { return Netns{}, nil, errNoNetns }

// Ucred stands for unix.Ucred.
type Ucred struct{ Pid, Uid, Gid int32 }

// PeerIn is Linux only.
func PeerIn(c net.Conn, want Netns) error { return errNoNetns }

func listenIn(nsPath string) (net.Listener, error) { return nil, errNoNetns }
