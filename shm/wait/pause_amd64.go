package wait

// pause executes the PAUSE instruction: it tells the core that this is a
// spin loop, which frees execution resources for the sibling hyperthread
// and, more to the point here, slows the loop's loads of the contended
// line so the writer's store can take it.
func pause()
