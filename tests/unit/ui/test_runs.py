from dflash_regen.ui.runs import first_failed


def test_a_run_stopped_at_its_earliest_failed_task_the_verdict_only_when_nothing_else_failed():
    def ti(task_id, map_index=-1):
        return {"task_id": task_id, "map_index": map_index, "try_number": 1}

    assert first_failed([]) is None
    where = first_failed([ti("check_published"), ti("generate", 3), ti("stage_weights"), ti("generate", 1)])
    assert where["task"] == "stage_weights"
    assert first_failed([ti("check_published"), ti("generate", 3), ti("generate", 1)])["task"] == "generate[1]"
    assert first_failed([ti("check_published")])["task"] == "check_published"
