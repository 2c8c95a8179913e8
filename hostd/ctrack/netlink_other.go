//go:build !linux

package ctrack

import (
	"context"
	"errors"
	"time"
)

// Netlink is the kernel Tracker; conntrack exists only on Linux.
type Netlink struct{}

var errNotLinux = errors.New("conntrack needs Linux")

// Dial fails: conntrack exists only on Linux.
func Dial(netnsPath string) (*Netlink, error) { return nil, errNotLinux }

// Lookup implements Tracker.
func (*Netlink) Lookup(Tuple) (Entry, error) { return Entry{}, errNotLinux }

// ClearMark implements Tracker.
func (*Netlink) ClearMark(Tuple, uint32) error { return errNotLinux }

// ClearMarks implements Tracker.
func (*Netlink) ClearMarks(uint32, time.Time) (int, error) { return 0, errNotLinux }

// Destroyed implements Tracker.
func (*Netlink) Destroyed(context.Context, func(Entry)) error { return errNotLinux }

// Close implements Tracker.
func (*Netlink) Close() error { return nil }
